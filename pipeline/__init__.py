"""The DAG core (config, dag, stage, storage, tracking, ray_env) and one subpackage per phase:
data/, train/, evaluate/. Stages import the core; the core imports no stage (dag.py names them by path)."""
