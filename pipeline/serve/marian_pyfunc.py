"""The registered model's pyfunc (MLflow "models from code"): sentences in, translations out.

The ``register`` stage saves this file as the model's code; MLflow loads it in
``mlflow.pyfunc.load_model("models:/<name>/<version>")`` and in ``mlflow models serve``. It
translates with the version's Hugging Face Marian folder (``artifacts/hf``: ``MarianMTModel`` +
``MarianTokenizer``, the export stage's exact mapping of ours) and ``generate()`` with the
decode settings the run used (``artifacts/decode.json``: beam size, alpha as HF's length
penalty |Y|^alpha), each batch at most a * |longest source| + b tokens long (§6.1,
``model.search.output_budget``; ``model/`` travels with the version as its code path). It imports neither this project's pipeline nor MLflow's
``transformers`` flavor. A model trained on preprocessed text (``artifacts/text.json``, e.g.
Multi30k's lowercased Moses tokens) gets its input preprocessed and its output detokenized with
sacremoses, as ``pipeline/decoding/text.py`` does for the translate CLI and the server (the pyfunc
cannot import the pipeline: ``tests/integration/test_multi30k_dag.py`` checks it against sacremoses).

Deviation: the version is a pyfunc model, not MLflow's ``transformers`` flavor, because that
flavor builds a ``transformers.pipeline`` and transformers 5 removed the ``translation`` task
(``KeyError: The task translation_en_to_de has been removed``); the folder inside is the same.
"""

from __future__ import annotations

from typing import Any

import mlflow
from mlflow.pyfunc import PythonModel

BATCH_SENTENCES = 16


class MarianTranslation(PythonModel):
    def load_context(self, context: Any) -> None:
        import json

        from transformers import MarianMTModel, MarianTokenizer

        hf = context.artifacts["hf"]
        self.tok = MarianTokenizer.from_pretrained(hf)
        self.model = MarianMTModel.from_pretrained(hf).eval()
        # predict bounds each batch by max_new_tokens (the §6.1 budget, within the position table);
        # the export's max_length (the table's size) would only make generate() warn that both are set.
        self.model.generation_config.max_length = None
        with open(context.artifacts["decode"], encoding="utf-8") as f:
            self.decode = json.load(f)
        self.text = {}
        if context.artifacts.get("text"):  # versions registered before it have none: plain text
            with open(context.artifacts["text"], encoding="utf-8") as f:
                self.text = json.load(f)
        self.moses = None  # (normalizer, tokenizer, detokenizer), built once where the text needs them
        if self.text.get("preprocess", "none") != "none":
            from sacremoses import MosesDetokenizer, MosesPunctNormalizer, MosesTokenizer

            src = self.text["src_lang"]
            self.moses = (MosesPunctNormalizer(lang=src), MosesTokenizer(lang=src),
                          MosesDetokenizer(lang=self.text["tgt_lang"]))

    def _source(self, line: str) -> str:
        """pipeline.decoding.text.lowercase_moses, where the training text was so preprocessed."""
        if self.moses is None:
            return line
        norm, tok, _ = self.moses
        return tok.tokenize(norm.normalize(line.lower()), escape=True, return_str=True)

    def _output(self, hyp: str) -> str:
        return hyp if self.moses is None else self.moses[2].detokenize(hyp.split())

    # The type hints are the model's signature (MLflow infers it from them when the model is saved)
    # and its input check: MLflow's wrapper of ``predict`` turns a one-column DataFrame (the scoring
    # server's ``{"inputs": [...]}``) into a list and rejects what is not a list of strings.
    def predict(self, context: Any, model_input: list[str], params: dict[str, Any] | None = None) -> list[str]:
        import torch
        from model.search import output_budget

        sentences = [self._source(s) for s in model_input]
        out: list[str] = []
        d = self.decode
        for i in range(0, len(sentences), BATCH_SENTENCES):
            batch = self.tok(sentences[i:i + BATCH_SENTENCES], return_tensors="pt", padding=True)
            longest = int(batch["attention_mask"].sum(dim=1).max())
            budget = output_budget(longest, d["max_len_a"], d["max_len_b"], self.model.config.max_position_embeddings)
            with torch.inference_mode():
                ids = self.model.generate(**batch, num_beams=d["beam_size"], length_penalty=d["alpha"],
                                          max_new_tokens=budget + 1)  # + 1: the eos
            out += [self._output(" ".join(t.split())) for t in self.tok.batch_decode(ids, skip_special_tokens=True)]
        return out


mlflow.models.set_model(MarianTranslation())
