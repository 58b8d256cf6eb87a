from bench.predictor.run import main

main()
