"""SGLang's `sglang.lang.chat_template` counterpart: chat roles from a jinja template."""

from frontend_dsl.chat_template import ChatTemplate, chatml_template, template_from_jinja

__all__ = ["ChatTemplate", "chatml_template", "template_from_jinja"]
