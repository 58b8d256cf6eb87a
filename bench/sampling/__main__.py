from bench.sampling.run import main

main()
