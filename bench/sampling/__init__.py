"""The cost of penalties and logit bias in the sampler: decode TPOT with plain sampling against
every row penalised (`python -m bench.sampling`)."""
