"""The served model name a model path implies when --served-model-name is not given."""

from __future__ import annotations

import os
import re

# Its own module so that state.py (ServerState.build) and metrics.py (the `model_name`
# label) share it without metrics importing state, which imports metrics.
_GGUF_SUFFIX = re.compile(r"(\.(Q\d\w*|F16|F32|BF16|IQ\w+))?\.gguf$", re.IGNORECASE)


def model_name_from_path(model_path: str) -> str:
    """`.../SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct`; a folder -> its name."""
    base = os.path.basename(os.path.normpath(model_path)) or model_path
    return _GGUF_SUFFIX.sub("", base)
