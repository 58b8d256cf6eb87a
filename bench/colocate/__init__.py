"""Co-location: finetune tokens/s harvested on a decode GPU and TPOT SLO attainment, per policy on
the same traces (`python -m bench.colocate`)."""
