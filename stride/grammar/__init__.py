"""Structured outputs: a request's :class:`~stride.params.Constraint` compiled to an llguidance grammar
(:mod:`.compile`, in the tokenizer processes), and the scheduler's matchers that turn each constrained sequence's
state into the token bitmask its next sample is drawn under (:mod:`.matchers`)."""
