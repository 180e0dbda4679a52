"""The DAG core (config, dag, stage, storage, tracking, ray_env, models, registry, packing), the
library shared by the phases (decoding/) and one subpackage per phase: data/, train/, evaluate/,
serve/. Phases import the library and the core; the library imports the core; the core imports no
stage (dag.py names them by path). Layers checked by import-linter (pyproject.toml)."""
