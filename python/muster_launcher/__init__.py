"""muster's side inside the ranks: what a training script imports, and what muster's start-up hook
loads into every rank it starts.

- `channel`: the connection to the agent (its socket, whether muster runs this process, the one
  line an error prints); every other module talks to the agent through it.
- `checkpoint`: the helper a script uses for muster's checkpoint barrier (`Checkpointer`).
- `autoreport`: the zero-code step reports for scripts that do not use the helper.
- `snapshot`: in-memory snapshots a script hands to the agent (`--snapshot-every`), and their restore.
- `importhook`: waits for a module to be imported, to patch it or to load one of muster's.
- `integrations`: one module per training framework (Hugging Face, Lightning), registered in one
  list that muster's `sitecustomize` (python/muster_sitecustomize.py) is generated from.

Standard library only, and importing this package imports nothing: every rank loads it at start.
The distribution is `muster-launcher` (python/pyproject.toml); the old module names
`muster_checkpoint` and `muster_frameworks` still import.
"""
