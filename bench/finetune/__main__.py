from bench.finetune.run import main

main()
