"""Sharing a trained model: the model card, the exact folder that goes to the Hub, and the upload.

A folder written by `save_pretrained` of a longrange model already holds what a user needs without our package:
`model.safetensors`, `config.json` with `auto_map`, and the modeling files (copied because `longrange/__init__.py`
registers the classes for the Auto classes). `prepare_hub_folder` rewrites such a folder into a clean upload folder
(plus tokenizer and model card), and `push_folder` uploads it with `huggingface_hub`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

MODEL_NAMES = {
    "compressive": "Compressive Transformer",
    "sinkhorn": "Sinkhorn Transformer",
}
PAPERS = {
    "compressive": "Rae et al., 2019, *Compressive Transformers for Long-Range Sequence Modelling* (arXiv:1911.05507)",
    "sinkhorn": "Tay et al., 2020, *Sparse Sinkhorn Attention* (arXiv:2002.11296)",
}
# config fields worth a line in the card (the full config.json sits next to it)
CARD_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "segment_length",
    "mem_len",
    "c_mem_len",
    "compression_rate",
    "compression_function",
    "reconstruction_loss",
    "bucket_size",
    "sinkhorn_iterations",
    "n_positions",
    "n_embd",
    "n_layer",
    "n_head",
)


def check_model_source(source: str | Path, need_tokenizer: bool = True) -> str:
    """Fail early, with a clear message, on a model argument that cannot load; returns it as a string.

    An existing path must be a `save_pretrained` folder (config.json, and a tokenizer when `need_tokenizer`); a string
    that looks like a path but does not exist is an error; anything else is taken as a Hub id.
    """
    source = str(source)
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise FileNotFoundError(f"{source} is not a saved model folder (no config.json in it)")
        if need_tokenizer and not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            raise FileNotFoundError(f"{source} has no tokenizer; save one there with tokenizer.save_pretrained")
        return source
    if source.startswith((".", "/", "~")) or source.count("/") > 1 or "\\" in source:
        raise FileNotFoundError(f"no such model folder: {source}")
    return source  # a Hub id


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_model_card(
    folder: str | Path,
    *,
    model=None,
    tokenizer=None,
    dataset: str | None = None,
    metrics: Mapping[str, float] | None = None,
    training_args: Mapping[str, Any] | None = None,
    repo_id: str | None = None,
    extra: str | None = None,
    prompt: str | None = None,
) -> Path:
    """Write `folder/README.md`, the Hub model card (a `huggingface_hub.ModelCard`: `ModelCardData` metadata, then
    the markdown below), and return its path.

    folder: a `save_pretrained` folder; its `config.json` is read when `model` is not given.
    model / tokenizer: optional live objects (parameter count, tokenizer class and vocabulary size).
    dataset: a sentence on the training data, e.g. "tinyshakespeare.txt, first 90% by position".
    metrics: name -> value, e.g. {"validation bits per character": 1.62}.
    training_args: the options training ran with (anything JSON-serialisable), shown as a table.
    repo_id: the Hub name used in the usage snippet (the folder path when absent).
    extra: markdown appended at the end.
    prompt: the usage example's prompt, text like the training data (`example_prompt` of it); a newline when absent.
    """
    folder = Path(folder)
    config = _card_config(folder, model)
    model_type = config.get("model_type", "unknown")
    # the metadata block the Hub reads (library, task, tags), written by huggingface_hub
    metadata = ModelCardData(
        library_name="transformers", pipeline_tag="text-generation", tags=["longrange", model_type, "custom_code"]
    )
    lines = [
        *_title(model_type, repo_id),
        *["", "## Training data", "", dataset or "Not recorded."],
        *_configuration_section(config, model, tokenizer),
        *_training_section(training_args),
        *_metrics_section(metrics),
        *_usage_section(repo_id or str(folder), prompt),
        *(["", extra] if extra else []),
    ]
    path = folder / "README.md"
    ModelCard(f"---\n{metadata.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n").save(path)
    return path


def _card_config(folder: Path, model) -> dict:
    """The config the card describes: the live model's, else the folder's config.json."""
    if model is not None:
        return model.config.to_dict()
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"write_model_card: {config_file} not found; pass `model=` or a save_pretrained folder")
    return json.loads(config_file.read_text(encoding="utf-8"))


def _title(model_type: str, repo_id: str | None) -> list[str]:
    """The card's heading (the repository name, else the model's), what the model is, and its paper."""
    name = MODEL_NAMES.get(model_type, model_type)
    lines = [
        f"# {repo_id.split('/')[-1] if repo_id else name}",
        "",
        f"A {name} language model built with longrange (the `longrange-transformers` distribution: the Compressive"
        " Transformer and the Sinkhorn Transformer as Hugging Face transformers models).",
    ]
    if model_type in PAPERS:
        lines += ["", f"Paper: {PAPERS[model_type]}."]
    return lines


def _table(heading: str, columns: tuple[str, str], rows: Mapping[str, Any]) -> list[str]:
    """A markdown section holding a two-column table."""
    lines = ["", heading, "", f"| {columns[0]} | {columns[1]} |", "| --- | --- |"]
    return lines + [f"| {key} | {_format_value(value)} |" for key, value in rows.items()]


def _code_keys(rows: Mapping[str, Any]) -> dict[str, Any]:
    """Option and field names shown as code."""
    return {f"`{key}`": value for key, value in rows.items()}


def _configuration_section(config: Mapping[str, Any], model, tokenizer) -> list[str]:
    """The config fields worth a line (CARD_CONFIG_FIELDS), the parameter count and the tokenizer when known."""
    lines = _table(
        "## Configuration", ("field", "value"), _code_keys({k: config[k] for k in CARD_CONFIG_FIELDS if k in config})
    )
    if model is not None:
        lines.append(f"| parameters | {sum(p.numel() for p in model.parameters()):,} |")
    if tokenizer is not None:
        lines.append(f"| tokenizer | {type(tokenizer).__name__}, {len(tokenizer)} tokens |")
    return lines + ["", "The full configuration is `config.json`."]


def _training_section(training_args: Mapping[str, Any] | None) -> list[str]:
    """The options training ran with; no section when they were not recorded."""
    return _table("## Training", ("option", "value"), _code_keys(training_args)) if training_args else []


def _metrics_section(metrics: Mapping[str, float] | None) -> list[str]:
    if metrics:
        return _table("## Metrics", ("metric", "value"), metrics)
    return ["", "## Metrics", "", "Not recorded."]


def example_prompt(text: str | bytes, length: int = 24) -> str:
    """The first characters of `text` for a usage example: its first non-blank line, cut to at most `length`
    characters (at the last space before the cut, when there is one)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="ignore")
    line = next((line for line in text.splitlines() if line.strip()), "")
    if len(line) <= length:
        return line
    cut = line.rfind(" ", 0, length + 1)
    return line[:cut] if cut > 0 else line[:length]


def _usage_section(load_name: str, prompt: str | None = None) -> list[str]:
    """How to load and sample the model from the Hub (or the folder) with transformers alone."""
    if prompt:
        prompt_lines = [f'inputs = tokenizer({prompt!r}, return_tensors="pt")  # the start of the training text']
    else:
        prompt_lines = [
            'inputs = tokenizer("\\n", return_tensors="pt")  # or the start of a text like the training data'
        ]
    return [
        "",
        "## Usage",
        "",
        "The modeling code ships with the weights, so `trust_remote_code=True` is all you need. (With the longrange"
        " package installed and imported, it is not needed: longrange is not on PyPI; install it from its"
        " repository, `pip install .` in a checkout, or from a wheel built there, `pip wheel . --no-deps`.)",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{load_name}", trust_remote_code=True)',
        # the folder's config.json names the remote classes, so the tokenizer loader asks for trust too
        f'tokenizer = AutoTokenizer.from_pretrained("{load_name}", trust_remote_code=True)',
        *prompt_lines,
        "output = model.generate(**inputs, max_new_tokens=100, do_sample=True, top_k=40)",
        "print(tokenizer.decode(output[0]))",
        "```",
    ]


def prepare_hub_folder(
    source: str | Path,
    out_dir: str | Path,
    *,
    trust_remote_code: bool = False,
    card: Mapping[str, Any] | None = None,
    repo_id: str | None = None,
) -> Path:
    """Write into `out_dir` exactly what `push_folder` uploads, from a saved model folder (or Hub id) `source`.

    The model is loaded and saved again, so the upload always has safetensors weights, `auto_map` in config.json and
    the modeling code next to them, whatever wrote `source`. The tokenizer in `source` is saved alongside. The model
    card is `source/README.md` when there is one and `card` is None (its usage snippet then loads `repo_id`);
    otherwise it is written from `card` (keyword arguments of `write_model_card`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import longrange  # noqa: F401  registers the longrange classes with the Auto classes

    source_path, out_dir = Path(source), Path(out_dir)
    if source_path.exists() and not (source_path / "config.json").is_file():
        raise FileNotFoundError(f"{source} has no config.json: give a folder written by save_pretrained")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} is not empty; the upload folder must hold only what is uploaded")
    model = AutoModelForCausalLM.from_pretrained(str(source), trust_remote_code=trust_remote_code)
    model.save_pretrained(out_dir)  # safetensors by default in transformers 5
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source))
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"{source} has no tokenizer; save one there with tokenizer.save_pretrained") from err
    tokenizer.save_pretrained(out_dir)
    if card is None and (source_path / "README.md").is_file():
        text = (source_path / "README.md").read_text(encoding="utf-8")
        if repo_id:  # the card was written for a local folder: point its usage snippet at the Hub name
            text = re.sub(r'from_pretrained\("[^"]*"', f'from_pretrained("{repo_id}"', text)
        (out_dir / "README.md").write_text(text, encoding="utf-8")
    else:
        card = {"repo_id": repo_id, **(card or {})}
        write_model_card(out_dir, model=model, tokenizer=tokenizer, **card)
    return out_dir


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    token: str | None = None,
    commit_message: str = "Upload longrange model",
) -> str:
    """Create `repo_id` on the Hub (if needed) and upload `folder` to it; returns the commit URL."""
    from huggingface_hub import create_repo, upload_folder

    folder = Path(folder)
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise FileNotFoundError(
            f"{folder} lacks config.json or safetensors weights: prepare it with prepare_hub_folder"
        )
    create_repo(repo_id, private=private, token=token, exist_ok=True, repo_type="model")
    info = upload_folder(
        repo_id=repo_id, folder_path=str(folder), token=token, commit_message=commit_message, repo_type="model"
    )
    return str(getattr(info, "commit_url", info))
