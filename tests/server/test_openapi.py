"""The OpenAPI document describes the API as it behaves: schemathesis (a tool nobody here wrote) sends
requests generated from it to a real `locus serve`, with its response checks on."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import httpx
import pytest

from tests.server.server_process import running_server

pytest.importorskip("schemathesis")
pytestmark = pytest.mark.slow  # a real server

# what schemathesis checks: no 5xx; every status, content type, header and body as documented; data
# the schema forbids is refused; a method the path does not take is a 405 with Allow
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
          "response_schema_conformance,negative_data_rejection,unsupported_method")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # a 32-token context bounds every generation a generated body can ask for
    with running_server("--model", "tiny", "--num-kv-blocks", "256", "--max-model-len", "32", "--enable-trace-api",
                        "--trace-dir", str(tmp_path_factory.mktemp("traces"))) as proc:
        yield proc


def test_the_document_lists_what_each_operation_really_answers(server):
    doc = httpx.get(f"{server.base_url}/openapi.json").json()
    ops = {(path, method): op for path, item in doc["paths"].items() for method, op in item.items()}
    for (path, method), op in ops.items():
        statuses = set(op["responses"])
        assert "422" not in statuses or path == "/ep/replan", (path, statuses)
        assert "200" in statuses and op["responses"]["200"]["content"], path
        for status, response in op["responses"].items():
            if status != "200" and path != "/health":
                assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert set(ops[("/v1/completions", "post")]["responses"]) == {"200", "400", "404", "500", "503"}
    assert set(ops[("/traces/start", "post")]["responses"]) == {"200", "400", "404", "409", "503", "507"}
    assert list(ops[("/metrics", "get")]["responses"]["200"]["content"]) == ["text/plain"]
    streamed = ops[("/v1/chat/completions", "post")]["responses"]["200"]["content"]
    assert set(streamed) == {"application/json", "text/event-stream"} and "itemSchema" in streamed["text/event-stream"]
    schemas = doc["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["logit_bias"]["anyOf"][0]["maxProperties"] == 1024  # --max-logit-bias
    assert completion["n"]["maximum"] == 128 and completion["max_tokens"]["maximum"] == 31  # the context, less one
    assert completion["prompt"]["anyOf"][1]["maxItems"] == 1024  # --max-prompts-per-request
    assert completion["stop"]["anyOf"][0]["maxLength"] == 4096  # --max-stop-chars
    assert completion["use_beam_search"]["enum"] == [None, False]  # known, not implemented: asks nothing only
    assert schemas["CompletionRequest"]["additionalProperties"] is False
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == 260  # the vocabulary


def test_schemathesis_finds_the_api_as_documented(server, tmp_path):
    har = tmp_path / "run.har"
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{server.base_url}/openapi.json", "--checks", CHECKS,
           "--phases", "examples,coverage,fuzzing", "--max-examples", "10", "--seed", "44", "--workers", "1",
           "--request-timeout", "120", "--no-shrink", "--report", "har", "--report-har-path", str(har)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=tmp_path)  # (its cache goes there)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    entries = json.loads(har.read_text())["log"]["entries"]
    statuses = Counter(e["response"]["status"] for e in entries)
    assert not [s for s in statuses if s >= 500], statuses
    streamed = Counter(e["request"]["url"].split(server.base_url)[1] for e in entries
                       if e["response"]["status"] == 200 and any(
                           h["name"].lower() == "content-type" and h["value"].startswith("text/event-stream")
                           for h in e["response"]["headers"]))
    assert streamed["/v1/completions"] >= 2 and streamed["/v1/chat/completions"] >= 1, streamed
    assert statuses[405] >= 14  # every path was tried with a method it does not take
    assert httpx.get(f"{server.base_url}/health").status_code == 200
