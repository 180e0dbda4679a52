"""Use the trained model: export (Hugging Face Marian folder, CTranslate2 models: the conversion is
pipeline.decoding.conversion), register (the MLflow Model Registry version) and the Ray Serve app.
May import the pipeline core, the shared library pipeline.decoding (Translator, setup_of) and
model/; never another phase; nothing imports it but the DAG table."""
