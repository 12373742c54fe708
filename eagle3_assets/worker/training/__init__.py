"""Stage `train`: the Trainer (trainer.py) and its pieces: batches and prefetch, the TTT loss and chain
attention, the draft model, checkpoints, held-out evaluation, resume, schedule, data parallelism, tracker."""
