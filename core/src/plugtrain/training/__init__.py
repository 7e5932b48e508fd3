"""The training loop: the trainer, its optimizer and schedule, the launch from a command line."""
