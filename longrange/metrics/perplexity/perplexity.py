"""Perplexity from per-token negative log-likelihoods (a local `evaluate` metric, loads offline).

Unlike the Hub's "perplexity" (which downloads a model and scores texts), this one takes what a training or evaluation
loop already has: the loss of each predicted token, in nats. Load it with `evaluate.load(path_to_this_folder)` or
`longrange.metrics.load_metric("perplexity")`.
"""

import math

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Perplexity = exp(mean negative log-likelihood per token); also bits per token = mean NLL / ln 2."
_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[float]`): negative log-likelihood of each scored token, in nats (natural log).
    num_bytes (`int`, optional): bytes of text the tokens cover; adds `bits_per_byte` = total NLL / ln 2 / num_bytes.
Returns:
    perplexity (`float`), nll (`float`, mean nats per token), bits_per_token (`float`), and bits_per_byte if asked.
Example:
    >>> perplexity = evaluate.load("longrange/metrics/perplexity")
    >>> perplexity.compute(predictions=[math.log(4), math.log(4)])["perplexity"]
    4.0
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Perplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("float64")}),
        )

    def _compute(self, predictions, num_bytes=None):
        nll = np.asarray(predictions, dtype=np.float64)
        if nll.size == 0:
            raise ValueError("perplexity of zero tokens is undefined")
        mean = float(nll.mean())
        result = {"perplexity": math.exp(mean), "nll": mean, "bits_per_token": mean / math.log(2)}
        if num_bytes is not None:
            if num_bytes <= 0:
                raise ValueError(f"num_bytes must be positive, got {num_bytes}")
            result["bits_per_byte"] = float(nll.sum()) / math.log(2) / num_bytes
        return result
