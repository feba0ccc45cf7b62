"""Plugin checks against SGLang 0.5.23's real classes, run in a fresh process per scenario.

``python tests/sglang_checks <scenario>`` loads plugins the way SGLang's processes do
(``sglang.srt.plugins.load_plugins()``), runs every check of the scenario (each isolated: one failing
check does not hide the others) and prints one ``RESULTS_JSON:`` line. SGLang's hook registry cannot be
undone, hence one process per scenario; tests/test_sglang_scenarios.py runs the scenarios and asserts.

Scenarios (the environment is set by the caller):
  on        SGLANG_CUPY_DSA_INDEX_K=bf16, SGLANG_PLUGINS=cupy_dsa: every hook, recall, guards
  off       switch unset, SGLANG_PLUGINS unset: SGLang unchanged; CLI flag and YAML key
  excluded  switch on but SGLANG_PLUGINS names another plugin only: nothing installed
  refusals  switch on: start-up refusals leave nothing patched
  fp8cupy   SGLANG_CUPY_DSA_INDEX_K=fp8-cupy, SGLANG_PLUGINS=cupy_dsa: SGLang's fp8 keys on cupy_dsa's store and
            kernels (bytes and top-k against SGLang's fp8 path)
  rescore   SGLANG_CUPY_DSA_INDEX_K=fp8-rescore, SGLANG_PLUGINS=cupy_dsa: two-level keys (SGLang's fp8 page + a
            residual page) and the rescored top-k (pool, budget, store bytes, top-k against the reference, PD,
            HiCache, refusals, flags)
  query     SGLANG_CUPY_DSA_INDEX_K=bf16, SGLANG_CUPY_DSA_INDEX_Q=bf16, SGLANG_PLUGINS=cupy_dsa: every mode x query
            setting through SGLang's forward (the query reaches the logits op, the top-k is the reference's with
            it), flag, YAML key and refusals
  refuse_installed  the installed SGLang must refuse start-up (exit status 3 if it did not)
"""
from __future__ import annotations

import json
import os
import sys

import harness  # first: makes SGLang importable on a CPU-only machine
import torch

from scenario_fp8cupy import scenario_fp8cupy
from scenario_off import scenario_excluded, scenario_off
from scenario_on import scenario_on
from scenario_query import scenario_query
from scenario_refusals import refuse_installed, scenario_refusals
from scenario_rescore import scenario_rescore

if __name__ == "__main__":
    torch.manual_seed(int(os.environ.get("CUPY_DSA_SEED", "0")))
    if sys.argv[1] == "refuse_installed":
        refuse_installed()
        sys.exit(0)
    {"on": scenario_on, "off": scenario_off, "excluded": scenario_excluded,
     "refusals": scenario_refusals, "fp8cupy": scenario_fp8cupy, "rescore": scenario_rescore,
     "query": scenario_query}[sys.argv[1]]()
    print("RESULTS_JSON:" + json.dumps({"results": harness.RESULTS, "info": harness.INFO}), flush=True)
