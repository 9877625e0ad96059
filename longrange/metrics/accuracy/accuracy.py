"""Accuracy: the fraction of predictions equal to their references (a local `evaluate` metric, loads offline).

Load it with `evaluate.load(path_to_this_folder)`, or `longrange.metrics.load_metric("accuracy")`.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Accuracy = (number of predictions equal to their reference) / (number of predictions)."
_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[int]`): predicted labels (token ids for a language model).
    references (`list[int]`): true labels, same length.
    sample_weight (`list[float]`, optional): a weight per prediction.
Returns:
    accuracy (`float`): in [0, 1].
Example:
    >>> accuracy = evaluate.load("longrange/metrics/accuracy")
    >>> accuracy.compute(predictions=[1, 2, 3, 4], references=[1, 2, 0, 4])
    {'accuracy': 0.75}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, sample_weight=None):
        predictions, references = np.asarray(predictions), np.asarray(references)
        if predictions.size == 0:
            raise ValueError("accuracy of zero predictions is undefined")
        correct = (predictions == references).astype(np.float64)
        if sample_weight is None:
            return {"accuracy": float(correct.mean())}
        weights = np.asarray(sample_weight, dtype=np.float64)
        return {"accuracy": float((correct * weights).sum() / weights.sum())}
