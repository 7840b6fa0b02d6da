"""SGLang's `sglang.lang.global_config`: the process-wide settings (the default backend)."""

from frontend_dsl.global_config import GlobalConfig, global_config

__all__ = ["GlobalConfig", "global_config"]
