"""`inferscale serve` end to end on a GPU machine: tiny bf16 Qwen2 (random weights), the fact
encoder on cuda beside the engine, every route once. Results go to $OUT/smoke.json and the
server's log to $OUT/front.log.

Run from the repository root, with vLLM importable (on a lent GPU machine: benchmarks/gpu/README.md):
    OUT=/tmp/out python3 benchmarks/serve_smoke.py
Last run: vLLM 0.26.0 on an H200 (benchmarks/results/serve_smoke_h200.json).
``SMOKE_VLLM_ARGS`` adds engine arguments (e.g. ``--tensor-parallel-size 2``).
"""
import json, os, signal, subprocess, sys, time, traceback
from pathlib import Path

import httpx

OUT = Path(os.environ["OUT"])
sys.path.insert(0, "tests")
os.environ["INFERSCALE_CACHE"] = "/tmp/iscache"
import tiny_models  # noqa: E402

res = {}


def note(k, v):
    res[k] = v
    (OUT / "smoke.json").write_text(json.dumps(res, indent=2, default=str))
    print(k, json.dumps(v, default=str)[:400], flush=True)


try:
    import torch
    model = tiny_models.tiny_model_dir("qwen2", "bfloat16")
    note("model", str(model))
    # the encoder on cuda vs cpu
    from inferscale.encode.encoder import FactEncoder
    enc = FactEncoder.from_spec(str(model), dtype="float32")
    ids = enc.tokenize("- Alice has a cat named Miso.\n")
    cpu = enc.encode_ids(ids, [1, 2, 3])
    enc.model.to("cuda")
    gpu = enc.encode_ids(ids, [1, 2, 3])
    note("encoder_cuda_vs_cpu_max_abs", [float((gpu.keys.float().cpu() - cpu.keys.float()).abs().max()),
                                         float((gpu.values.float().cpu() - cpu.values.float()).abs().max())])
    enc.close()
    cfg = Path("/tmp/smoke.toml")
    data = Path("/tmp/smoke-data")
    cfg.write_text(f'data_dir = "{data}"\n[model]\npath = "{model}"\ndtype = "bfloat16"\nencode_dtype = "bfloat16"\n'
                   f'[embedder]\nname = "minilm"\n[embedder.options]\nmodel_path = "{model}"\n')
    port = 18555
    log = open(OUT / "front.log", "wb")
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "inferscale.cli", "serve", str(model), "--config", str(cfg),
                             "--port", str(port), "--encoder-device", "cuda", "--enforce-eager",
                             *os.environ.get("SMOKE_VLLM_ARGS", "").split()],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    while time.time() - start < 420:
        if proc.poll() is not None:
            raise RuntimeError(f"front exited {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(2)
    note("ready_s", time.time() - start)
    note("nvidia_smi", subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv"],
                                      capture_output=True, text=True).stdout)
    c = httpx.Client(base_url=base, timeout=120)
    r = c.post("/v1/memories", json={"user_id": "alice@example.com", "facts": [
        "Alice has a cat named Miso.", "Alice works as a nurse in Lisbon.", "Alice likes jazz."]})
    note("add", [r.status_code, r.json()])
    chat = {"model": str(model), "user": "alice@example.com", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is my cat called?"}]}
    r = c.post("/v1/chat/completions", json=chat)
    note("chat", [r.status_code, r.json()])
    whole = r.json()["choices"][0]["message"]["content"]
    with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
        lines = [l for l in s.iter_lines() if l.startswith("data:")]
    text = "".join((json.loads(l[5:])["choices"] or [{}])[0].get("delta", {}).get("content", "") or ""
                   for l in lines if l.strip() != "data: [DONE]")
    note("stream", {"n": len(lines), "same_text": text == whole, "last": lines[-1]})
    r = c.post("/v1/chat/completions", json={**chat, "inferscale": {"mode": "text"}})
    note("chat_text_mode", [r.status_code, r.json().get("inferscale")])
    r = c.post("/v1/completions", json={"model": str(model), "prompt": [1, 2], "kv_transfer_params": {"inferscale": {}}})
    note("forged", [r.status_code, r.json()])
    time.sleep(2)
    m = c.get("/metrics").text
    note("metrics", [l for l in m.splitlines() if l.startswith(("vllm:inferscale", "inferscale_retrieval_seconds_count",
                                                                "inferscale_compose_seconds_count"))])
    r = c.delete("/v1/memories", params={"user_id": "alice@example.com"})
    note("forget", [r.status_code, r.json()])
    os.kill(proc.pid, signal.SIGTERM)
    note("front_exit", proc.wait(timeout=90))
except Exception:
    note("error", traceback.format_exc())
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except Exception:
        pass
