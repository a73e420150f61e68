"""A client's request read by the router (locus/router/intake.py): what goes to each kind of backend."""

import json

from starlette.datastructures import Headers

from locus.router.intake import Intake
from locus.router.prompts import PromptTokenizer
from tests.router.route_fixtures import MINI

TOKENIZER = PromptTokenizer.load(MINI)


def read(kind: str, raw: bytes, headers: dict[str, str] | None = None):
    scope = {"type": "http", "headers": [(k.lower().encode(), v.encode("latin-1")) for k, v in (headers or {}).items()]}
    return Intake(TOKENIZER, kind, ("mini",)).read("completions", raw, Headers(scope=scope))


def test_a_locus_backend_gets_the_client_s_body_with_the_request_id_added():
    raw = b' {"model": "mini", "prompt": "caf\xc3\xa9 \\u00e9", "domain": "code", "max_tokens": 4}\n'
    request, out = read("locus", raw, {"X-Request-Id": "q\u00e9-1"})
    assert request.request_id == "q\u00e9-1" and request.domain == "code"
    assert json.loads(out.body) == {**json.loads(raw), "request_id": "q\u00e9-1"}
    assert out.body.startswith(raw.strip()[:-1])  # the client's bytes, the id written in before the brace
    same = b'{"prompt": "x", "request_id": "r1"}'
    assert read("locus", same)[1].body == same


def test_a_body_that_is_not_utf8_is_re_serialised_and_other_kinds_lose_the_tag():
    raw = json.dumps({"prompt": "x", "domain": "code"}).encode("utf-16")
    request, out = read("locus", raw)
    assert json.loads(out.body) == {"prompt": "x", "domain": "code", "request_id": request.request_id}
    assert len(request.request_id) == 24
    request, out = read("sglang", b'{"prompt": "x", "domain": "code"}')
    assert json.loads(out.body) == {"prompt": "x", "rid": request.request_id}
    assert json.loads(read("vllm", b'{"prompt": "x", "domain": "code"}')[1].body) == {"prompt": "x"}
