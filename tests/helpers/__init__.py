"""Code the tests share (none of it is collected; `pythonpath = ["tests"]` makes it importable):

- requests.py: `make_request`, a core Request (torch-free, for tests/core)
- fake_runner.py: `FakeRunner`, the runner's side of the scheduler protocol, checking invariants
- hf_models.py: tiny HF model directories (`make_hf_model`, `build_tokenizer`), and HF's greedy
  continuations (`hf_greedy`, `load_hf_model`); torch and transformers imported on use
- attention.py: ragged paged-attention batches and their dense answer (kernel tests)
- hybrid_batch.py: ragged batches as the hybrid KV cache leaves them (garbage in freed
  blocks), and the CPU / Triton attention ops run on them (sliding-window and sink tests)
- server.py: `serving`, `tiny_app`, `free_port`, `wait_healthy`, `assert_error`
- soak_client.py: the soak test's request plan and client
- browser.py: `headless_chromium`, Debian's Chromium driven by selenium (also used by
  scripts/screenshots.py)
"""
