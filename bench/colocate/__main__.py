from bench.colocate.run import run_and_exit

run_and_exit()
