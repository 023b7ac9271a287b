"""One-off GPU diagnostic: where gemma2's float32 divergence from HF comes from."""
import json, os, subprocess, sys, time, traceback
sys.path.insert(0, "tests"); sys.path.insert(0, "scripts"); sys.path.insert(0, ".")
import torch
import gpu_check as gc
from pathlib import Path
from helpers.hf_models import SLIDING_CASES, make_hf_model
from aserve import SamplingParams
from aserve.backends import cuda as cuda_backend
from aserve.backends.ops import REF_OPS
DEV = os.environ.get("DEV", "cuda")
OUT = Path(os.environ.get("OUT", "/tmp"))
results = {}
def save():
    (OUT / "diag.json").write_text(json.dumps(results, indent=1, default=str))
def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)
params = SamplingParams(temperature=0.0, max_tokens=gc.NUM_NEW, min_tokens=gc.NUM_NEW, logprobs=5)
root = Path("/tmp/diagm"); root.mkdir(exist_ok=True)
models, refs = {}, {}
def model(name, **ov):
    if name not in models:
        arch, base = SLIDING_CASES.get(name.split(":")[0], ("llama", {}))
        models[name] = make_hf_model(root / name.replace(":", "_"), arch, **{**base, **ov})
        refs[name] = gc.hf_greedy(models[name], "float32", DEV, gc.parity_prompts(models[name]))
    return models[name]
orig_ops = cuda_backend.CudaPlatform.kernel_ops
def case(key, name, ov=None, ref_ops=False, **kw):
    t0 = time.time()
    try:
        d = model(name, **(ov or {}))
        cuda_backend.CudaPlatform.kernel_ops = (lambda self, dt: REF_OPS) if ref_ops else orig_ops
        outs, info = gc.run_llm(d, gc.parity_prompts(d), params, dtype="float32", device=DEV, **kw)
        r = gc.compare_greedy(*gc.aserve_chosen(outs), *refs[name])
        results[key] = {"equal": f"{r['num_equal']}/{r['num_prompts']}", "maxd": r["max_abs_logprob_diff"],
                        "div": r["divergences"][:3], "info": info, "s": round(time.time() - t0, 1)}
    except Exception:
        results[key] = {"error": traceback.format_exc()[-2000:]}
    cuda_backend.CudaPlatform.kernel_ops = orig_ops
    log(key, results[key] if "error" in results[key] else {k: results[key][k] for k in ("equal", "maxd", "s")})
    save()
case("g2_default", "gemma2")
case("g2_ref_ops", "gemma2", ref_ops=True)
case("g2_eager", "gemma2", enforce_eager=True)
case("g2_nowarmup_eager", "gemma2", enforce_eager=True, warmup=False)
case("g2_budget512_eager", "gemma2", enforce_eager=True, max_num_batched_tokens=512)
case("g2_blocks2k_eager", "gemma2", enforce_eager=True, num_kv_blocks=2048)
case("g2_nocap", "gemma2:nocap", dict(attn_logit_softcapping=None), enforce_eager=True)
case("g2_nowin", "gemma2:bigwin", dict(sliding_window=512), enforce_eager=True)
case("g2_nofinalcap", "gemma2:nofinal", dict(final_logit_softcapping=None), enforce_eager=True)
case("llama_default", "llama")
# graphs vs eager, float32, llama
try:
    d = model("llama")
    import random
    rng = random.Random(1)
    lengths = [1, 15, 16, 17, 33, 250] + [rng.randrange(2, 200) for _ in range(18)]
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]
    ps = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 80), ignore_eos=True) for _ in prompts]
    for dt in ("float32", "bfloat16"):
        e, _ = gc.run_llm(d, prompts, ps, enforce_eager=True, dtype=dt, device=DEV)
        g, gi = gc.run_llm(d, prompts, ps, dtype=dt, device=DEV)
        results[f"llama_graphs_vs_eager_{dt}"] = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(e, g))
        log(f"llama graphs vs eager {dt}", results[f"llama_graphs_vs_eager_{dt}"], "/ 24", gi)
except Exception:
    results["gve_error"] = traceback.format_exc()[-2000:]
save()
for name, paths in (("sliding", ["tests/kernels/test_sliding_window.py"]), ("triton", ["tests/kernels/test_kernels_triton.py"]))[:int(os.environ.get("NPY", 2))]:
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", *paths, "-q", "-x", "-n", "8", "-p", "no:cacheprovider"],
                           capture_output=True, text=True, timeout=100)
        results[f"pytest_{name}"] = {"rc": p.returncode, "tail": (p.stdout + p.stderr)[-2500:], "s": round(time.time() - t0, 1)}
    except subprocess.TimeoutExpired as ex:
        results[f"pytest_{name}"] = {"rc": "timeout", "tail": str(ex.stdout)[-1500:]}
    log(name, results[f"pytest_{name}"].get("rc"), results[f"pytest_{name}"].get("s"), results[f"pytest_{name}"]["tail"][-300:])
    save()
