"""``cupy-dsa bench``: bytes/token, throughput and recall of the index-key layouts (installed as
``cupy_dsa.bench``). One module per subcommand: :mod:`.bytes`, :mod:`.sweeps` (store, query, logits) with
:mod:`.verify_extend` (the logits' verify and extend rows), :mod:`.recall`; :mod:`.models` (the V4 models serve and
the sweeps measure); :mod:`.timing` (CUDA-graph timing, ceilings), :mod:`.provenance` (the JSON document: schema,
commit), :mod:`.report` (tables, markdown), :mod:`.plots`, :mod:`.readme` (README blocks), :mod:`.cli` (click: the
groups) and ``cli_*`` (the commands, one module per group). The bench calls only the public ops of :mod:`cupy_dsa`."""
