"""Chat templates: found in a checkpoint directory and rendered as transformers renders them (a
sandboxed jinja2 environment with its globals). A leaf module, so that the engine's tokenizer and the
router (locus/router/, which tokenizes prompts to predict where they go and talks to engines only over
HTTP) render a conversation to the same text, and so to the same token ids."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from locus.errors import LocusError


def read_chat_template(value: str) -> str:
    """--chat-template: a file's contents if `value` names a file, else the template itself; its
    Jinja syntax is checked here, so a broken template fails at start-up, not on the first request."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    path = Path(value)
    try:
        template = path.read_text() if len(value) < 4096 and path.is_file() else value
    except OSError as exc:
        raise LocusError(f"--chat-template {value}: cannot read it ({exc.strerror})") from None
    if "{" not in template:
        raise LocusError(f"--chat-template {value!r}: no such file, and not a Jinja template")
    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise LocusError(f"--chat-template: Jinja syntax error at line {exc.lineno}: {exc.message}") from None
    return template


def render_chat_template(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool, **extra: Any) -> str:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise LocusError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)
    except jinja2.TemplateError as exc:
        raise LocusError(f"chat template failed to render: {exc}") from None


def find_chat_template(model_dir: Path, cfg: dict) -> str | None:
    """The checkpoint's template: chat_template.jinja, else tokenizer_config.json's (`cfg`), else
    chat_template.json's; a list of named ones gives "default"; None without any."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = cfg.get("chat_template")
    if template is None:
        template = (read_json(model_dir / "chat_template.json") or {}).get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def read_json(path: Path) -> dict | None:
    """A JSON file of the checkpoint, None if absent; a broken one is refused by name."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise LocusError(f"{path}: not valid JSON ({exc})") from None
