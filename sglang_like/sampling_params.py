"""Per-request sampling parameters: the one dataclass that travels from the edge to the sampler."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

_MAX_NEW_TOKENS_LIMIT = 1 << 20
# Every stop string is looked for after every token, and stop ids checked per token: caps
# as the OpenAI routes have, so one request cannot slow every other one's decode step.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
# DRY's sequence breakers are matched against every vocabulary entry once per distinct list
# (then cached): bounded like the stop strings. 40 characters is llama.cpp's cut.
MAX_DRY_BREAKERS = 16
MAX_DRY_BREAKER_CHARS = 40
DEFAULT_DRY_BREAKERS = ("\n", ":", "\"", "*")


@dataclass
class SamplingParams:
    """What a request asks of decoding. Field names follow SGLang's `sampling_params`.

    `validate()` raises ValueError naming the bad field; the HTTP edge turns that into a 400.
    Constraint fields (`regex`, `json_schema`, `json_object`, `ebnf`, `structural_tag`) are
    mutually exclusive.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    regex: str | None = None
    json_schema: str | dict | None = None
    json_object: bool = False
    ebnf: str | None = None
    # xgrammar's structural tag (SGLang's `structural_tag`): a JSON string or object
    structural_tag: str | dict | None = None
    # OpenAI's logit_bias: token id (a string in JSON) -> a number in [-100, 100] added to that
    # token's logit before sampling (greedy included); -100 bans it. Logprobs stay the model's.
    logit_bias: dict[str, float] | None = None
    # DRY ("don't repeat yourself", llama.cpp's names and defaults): a token that would extend
    # a repeat of dry_allowed_length or more context tokens loses
    # dry_multiplier * dry_base ** (repeat_len - dry_allowed_length) from its logit.
    # dry_multiplier 0 is off; dry_penalty_last_n -1 is the whole context, 0 off;
    # dry_sequence_breakers None are DEFAULT_DRY_BREAKERS (a repeat never spans one).
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] | None = None
    # XTC ("exclude top choices"): with probability xtc_probability a step drops every token
    # whose probability is at least xtc_threshold except the least likely of them (when two or
    # more are). 0 is off.
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a request's dict; unknown keys are a ValueError (a typo should not pass)."""
        if d is None:
            return cls()
        if isinstance(d, SamplingParams):
            return dataclasses.replace(d)
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        params = cls(**{k: v for k, v in d.items() if v is not None or k in _NULLABLE})
        params.validate()
        return params

    def replace_for_sample(self, index: int) -> SamplingParams:
        """The params of sample `index` of an n > 1 request: n = 1, and a distinct seed."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- derived views ------------------------------------------------------------------
    @property
    def stop_strs(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or (self.dry_multiplier != 0.0 and self.dry_penalty_last_n != 0)  # has_dry
        )

    @property
    def has_dry(self) -> bool:
        return self.dry_multiplier != 0.0 and self.dry_penalty_last_n != 0

    @property
    def dry_breakers(self) -> tuple[str, ...]:
        """The sequence breakers in effect (llama.cpp's four when unset)."""
        if self.dry_sequence_breakers is None:
            return DEFAULT_DRY_BREAKERS
        return tuple(self.dry_sequence_breakers)

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, spec) of the grammar this request asks for, or None. Kinds: regex, json, ebnf."""
        if self.regex is not None:
            return ("regex", self.regex)
        if self.json_schema is not None:
            spec = self.json_schema
            # key order is kept: a schema's property order is the order the output follows
            return ("json", spec if isinstance(spec, str) else json.dumps(spec))
        if self.json_object:
            return ("json", _ANY_JSON_OBJECT)
        if self.ebnf is not None:
            return ("ebnf", self.ebnf)
        if self.structural_tag is not None:
            tag = self.structural_tag
            return ("structural_tag", tag if isinstance(tag, str) else json.dumps(tag))
        return None

    # ---- checks -------------------------------------------------------------------------
    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError with the field and the reason when a value is out of range."""
        _check_int("max_new_tokens", self.max_new_tokens, 0, _MAX_NEW_TOKENS_LIMIT)
        _check_int("min_new_tokens", self.min_new_tokens, 0, _MAX_NEW_TOKENS_LIMIT)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must not exceed "
                f"max_new_tokens ({self.max_new_tokens})"
            )
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p <= 0.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, -1, 1 << 30)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (off) or a positive integer, got 0")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 2.0)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_int("n", self.n, 1, 128)
        if self.seed is not None:
            _check_int("seed", self.seed, -(1 << 63), (1 << 63) - 1)
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "json_object"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        stops = self.stop
        if stops is not None:
            if isinstance(stops, str):
                stops = [stops]
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise ValueError("stop must be a string or a list of strings")
            if any(s == "" for s in stops):
                raise ValueError("stop strings must not be empty")
            if len(stops) > MAX_STOP_STRINGS:
                raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
            if any(len(s) > MAX_STOP_CHARS for s in stops):
                raise ValueError(f"a stop string is at most {MAX_STOP_CHARS} characters")
            self.stop = list(stops) if isinstance(self.stop, list) else self.stop
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list):
                raise ValueError("stop_token_ids must be a list of integers")
            if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
                raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got "
                                 f"{len(self.stop_token_ids)}")
            for t in self.stop_token_ids:
                _check_int("stop_token_ids[]", t, 0, (vocab_size or (1 << 31)) - 1)
        n_constraints = sum(
            x is not None for x in (self.regex, self.json_schema, self.ebnf, self.structural_tag)
        ) + int(bool(self.json_object))
        if n_constraints > 1:
            raise ValueError(
                "only one of regex, json_schema, json_object, ebnf, structural_tag may be set"
            )
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("regex must be a string")
        if self.json_schema is not None and not isinstance(self.json_schema, (str, dict)):
            raise ValueError("json_schema must be a JSON Schema object or a string holding one")
        if self.ebnf is not None and not isinstance(self.ebnf, str):
            raise ValueError("ebnf must be a string")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise ValueError("structural_tag must be an object or a string holding one")
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias, vocab_size)
        self._validate_dry_xtc()

    def _validate_dry_xtc(self) -> None:
        _check_float("dry_multiplier", self.dry_multiplier, 0.0, 100.0)
        _check_float("dry_base", self.dry_base, 1.0, 100.0)
        _check_int("dry_allowed_length", self.dry_allowed_length, 1, _MAX_NEW_TOKENS_LIMIT)
        _check_int("dry_penalty_last_n", self.dry_penalty_last_n, -1, 1 << 30)
        breakers = self.dry_sequence_breakers
        if breakers is not None:
            if not isinstance(breakers, list) or not all(isinstance(b, str) for b in breakers):
                raise ValueError("dry_sequence_breakers must be a list of strings")
            if len(breakers) > MAX_DRY_BREAKERS:
                raise ValueError(f"at most {MAX_DRY_BREAKERS} dry_sequence_breakers, "
                                 f"got {len(breakers)}")
            if any(b == "" or len(b) > MAX_DRY_BREAKER_CHARS for b in breakers):
                raise ValueError("each of dry_sequence_breakers must have 1 to "
                                 f"{MAX_DRY_BREAKER_CHARS} characters")
            if not all(b.isascii() or _is_utf8(b) for b in breakers):
                raise ValueError("dry_sequence_breakers must be valid Unicode text (a lone "
                                 "surrogate is not)")
        _check_float("xtc_probability", self.xtc_probability, 0.0, 1.0)
        _check_float("xtc_threshold", self.xtc_threshold, 0.0, 1.0)
        if self.xtc_probability > 0.0 and self.is_greedy:
            # greedy decoding takes the top token, which is what XTC would exclude
            raise ValueError("xtc_probability needs sampling: it is not available with "
                             "temperature 0 or top_k 1 (greedy decoding)")

    @property
    def token_bias(self) -> dict[int, float]:
        """logit_bias by integer token id ({} when unset); valid once `validate()` ran."""
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}


_NULLABLE = {"stop", "stop_token_ids", "seed", "regex", "json_schema", "ebnf", "structural_tag",
             "logit_bias"}
_MAX_LOGIT_BIAS_ENTRIES = 1024
_MAX_LOGIT_BIAS = 100.0
_ANY_JSON_OBJECT = '{"type": "object"}'


def _checked_logit_bias(bias: Any, vocab_size: int | None) -> dict[str, float]:
    """{token id as a decimal string: bias}: keys ints or strings of one, values numbers in
    [-100, 100], at most 1024 entries."""
    if not isinstance(bias, dict):
        raise ValueError("logit_bias must be an object mapping token ids to numbers")
    if len(bias) > _MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias takes at most {_MAX_LOGIT_BIAS_ENTRIES} tokens")
    hi = (vocab_size or (1 << 31)) - 1
    out: dict[str, float] = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str) and key.strip().isdigit():
            token = int(key)
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= hi:
            raise ValueError(f"logit_bias keys must be token ids in [0, {hi}], got {key!r}")
        _check_float(f"logit_bias[{key}]", value, -_MAX_LOGIT_BIAS, _MAX_LOGIT_BIAS)
        out[str(token)] = float(value)
    return out


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")


def _check_float(name: str, value: Any, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value or not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")


__all__ = ["SamplingParams"]
