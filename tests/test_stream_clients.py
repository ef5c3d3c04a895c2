"""Streams across an engine's death as real clients parse them (issue 20).

On an H100, vLLM's own benchmark client saw 115 of 128 streams that the proxy resent
whole as failed ("Never received a valid chunk"), and 3 continued ones short: its parser
strips every read it gets and glues it to what it holds, so a keep-alive comment that
arrives alone (`: keep-alive`) stays at the head of its buffer and every event after it
is glued behind it and dropped as part of a comment, until a read happens to carry two
events. Here the same client, the one in the engine's virtualenv, reads streams through
the proxy while the fake engine dies under them: some before their first token (resent
whole), some mid-answer (continued), all waiting with keep-alives for the restart.
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import pytest

from tests import continuation_streams
from tests.continuation_streams import expected_text, metrics
from tests.fake_tokens import prompt_ids
from tests.harness import ROOT, wait_for
from tests.test_proxy import url

fronted = continuation_streams.fronted  # (the fixture: a daemon before a fake engine)

ENGINE_PY = ROOT / ".venv-engine" / "bin" / "python"
CLIENT = Path(__file__).with_name("vllm_bench_client.py")
TOKENS = 120


@pytest.mark.e2e  # needs .venv-engine (vLLM's client); the engine is the fake one
@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_vllm_bench_client_gets_every_token_of_resent_and_continued_streams(
        fronted, tmp_path, backend):
    # every answer starts after 1.5 s (its prefill); the restarted engine listens after
    # 1 s; keep-alives every 0.5 s while the streams wait
    d, cfg = fronted("--first-token-delay", "1.5", "--startup-delay", "1", keepalive_s=0.5)
    path = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    # two streams answering when the engine dies, two still in their prefill
    specs = ["0:alpha:120", "0:bravo:120", "2.2:charlie:120", "2.2:delta:120"]
    proc = subprocess.Popen([str(ENGINE_PY), str(CLIENT), url(cfg, path), "fake", backend,
                             *specs], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=str(tmp_path))
    got: dict[str, str] = {}

    def read() -> None:
        got["out"], got["err"] = proc.communicate(timeout=120)

    reader = threading.Thread(target=read)
    reader.start()
    # (the proxy's gate counts the client's streams; the canary goes to the engine)
    wait_for(lambda: d.status()["admission"]["in_flight"] >= 4, 60,
             "the four streams at the proxy")
    (tmp_path / "fault").write_text("die")
    reader.join(125)
    assert proc.returncode == 0, got.get("err", "")[-3000:]
    seen = json.loads(got["out"])
    for spec, s in zip(specs, seen, strict=True):
        prompt = spec.split(":")[1]
        doc = ({"messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}]}
               if backend == "openai-chat" else {"prompt": prompt})
        want = expected_text(prompt_ids(doc, backend == "openai-chat"), TOKENS)
        assert s["success"], (spec, s["error"])
        assert s["text"] == want, (spec, len(s["text"]), len(want))
        assert s["output_tokens"] == TOKENS, spec
    assert d.status()["restarts"] == 1
    m = metrics(cfg)
    n = {o: m[("vllm_supervisor_proxy_continuations_total", (("outcome", o),))]
         for o in ("continued", "resent", "failed", "refused")}
    # a chat answer's role chunk goes out before its prefill: those two are continued
    assert n == {"continued": 2 if backend == "openai" else 4,
                 "resent": 2 if backend == "openai" else 0, "failed": 0, "refused": 0}
