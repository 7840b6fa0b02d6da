"""Role prefixes/suffixes, derived by rendering the model's jinja chat template with sentinels."""

from __future__ import annotations

from dataclasses import dataclass, field

_ROLES = ("system", "user", "assistant")
_SENTINEL = {r: f"\x1f{r.upper()}_CONTENT\x1f" for r in _ROLES}


@dataclass(frozen=True)
class ChatTemplate:
    """How each role is wrapped in the prompt text.

    `default_system` is the text the template inserts when the conversation does not start
    with a system message (SmolLM2 does this); it is prepended before the first non-system role.
    """

    role_prefix: dict[str, str] = field(default_factory=dict)
    role_suffix: dict[str, str] = field(default_factory=dict)
    default_system: str = ""
    source: str = "chatml"

    def prefix(self, role: str) -> str:
        return self.role_prefix.get(role, "")

    def suffix(self, role: str) -> str:
        return self.role_suffix.get(role, "")


def chatml_template() -> ChatTemplate:
    """The fallback when the backend reports no template."""
    return ChatTemplate(
        role_prefix={r: f"<|im_start|>{r}\n" for r in _ROLES},
        role_suffix={r: "<|im_end|>\n" for r in _ROLES},
        source="chatml",
    )


def template_from_jinja(
    jinja_source: str | None, bos_token: str = "", eos_token: str = ""
) -> ChatTemplate:
    """Derive role prefix/suffix strings from a jinja chat template; ChatML when none is given.

    Renders growing conversations [system, user, assistant] with sentinel contents and takes
    the text each new message adds; a template that cannot be split this way raises ValueError.
    """
    if not jinja_source:
        return chatml_template()
    render = _compile(jinja_source, bos_token, eos_token)
    msgs = [{"role": r, "content": _SENTINEL[r]} for r in _ROLES]
    prefixes: dict[str, str] = {}
    suffixes: dict[str, str] = {}
    previous = render([])
    for i, role in enumerate(_ROLES):
        full = render(msgs[: i + 1])
        if not full.startswith(previous):
            raise ValueError(f"chat template is not prefix-stable at the {role} message")
        added = full[len(previous):]
        if _SENTINEL[role] not in added:
            raise ValueError(f"chat template drops the {role} message content")
        prefixes[role], suffixes[role] = added.split(_SENTINEL[role], 1)
        previous = full
    if previous.startswith(render([]) + prefixes["system"]):
        # a leading constant (e.g. bos) belongs to the very first message only
        head = render([])
        prefixes["system"] = head + prefixes["system"]
    lone_user = render([msgs[1]])
    user_block = prefixes["user"] + _SENTINEL["user"] + suffixes["user"]
    if not lone_user.endswith(user_block):
        raise ValueError("chat template renders a lone user message unexpectedly")
    default_system = lone_user[: -len(user_block)]
    return ChatTemplate(prefixes, suffixes, default_system, source="jinja")


def _compile(source: str, bos_token: str, eos_token: str):  # noqa: ANN202 - local closure
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template error: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        undefined=jinja2.Undefined)
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(source)

    def render(messages: list[dict]) -> str:
        return template.render(messages=messages, add_generation_prompt=False,
                               bos_token=bos_token, eos_token=eos_token)

    return render
