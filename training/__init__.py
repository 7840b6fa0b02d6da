"""Training EAGLE-3 draft heads for a target model (`python -m training.train_eagle`). Not
part of the runtime: the runtime only loads the heads this writes."""
