"""SGLang's `sglang.lang.backend` package: the DSL's backends under SGLang's module names."""
