"""The text-generation pipeline with a `TextIteratorStreamer`, as a chat front end serves a model: generation runs in
a thread while the caller reads text as it comes. Saved folders are loaded by path with `trust_remote_code=True`;
the streamed text must be the pipeline's own result, which must be plain greedy decoding without a cache (a loop
of full forwards written here). transformers' Llama is the reference behaviour."""

from __future__ import annotations

from threading import Thread

import pytest
import torch
from client_utils import TOKENIZER, causal_models
from transformers import TextIteratorStreamer, pipeline

MODELS = causal_models(max_positions=128)
PROMPT, NEW_TOKENS = "To be, or not to be: that is the question.", 30  # prompt and answer span several segments


@pytest.mark.parametrize("name", list(MODELS))
def test_pipeline_streams_the_greedy_continuation(name, tmp_path):
    torch.manual_seed(0)
    MODELS[name]().save_pretrained(tmp_path)
    TOKENIZER.save_pretrained(tmp_path)
    generator = pipeline("text-generation", model=str(tmp_path), trust_remote_code=True)
    streamer = TextIteratorStreamer(generator.tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=60)
    results = []
    kwargs = dict(streamer=streamer, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    thread = Thread(target=lambda: results.append(generator(PROMPT, **kwargs)))
    thread.start()
    pieces = list(streamer)
    thread.join()
    assert len(pieces) > 1, "the text arrives in pieces, while generating"

    ids = TOKENIZER(PROMPT, add_special_tokens=False)["input_ids"]
    model = generator.model
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            logits[TOKENIZER.eos_token_id] = -float("inf")  # min_new_tokens: no end of text before the last token
            ids.append(int(logits.argmax()))
    expected = TOKENIZER.decode(ids[len(PROMPT) :], skip_special_tokens=True)
    assert "".join(pieces) == expected
    assert results[0][0]["generated_text"] == PROMPT + expected
