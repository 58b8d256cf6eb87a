from predictor_models.cli import main

main()
