"""Speculative decoding without a draft model.

Drafts come from text that is already there: the request's own prompt and output (the longest
suffix that occurred before, and what followed it), the outputs other requests of the same
cache salt are writing or wrote (``ngram_index.py``), and the radix cache's paths, which hold
what earlier requests produced after exactly this request's tokens (``drafter.py``). One
forward computes a request's last token and its draft together; the engine then takes the
tokens the model agrees with (``acceptance.py``: greedy rows accept a draft token that is the
argmax, sampled rows by the speculative-sampling rule, so the output distribution is the
model's) and rolls the rest back. How many tokens each request drafts in a step follows its
recent acceptance and what a verified token costs on this device (``step_cost.py``).
"""
