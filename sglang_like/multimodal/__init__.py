"""Image input: decoding and limits (images), preprocessing and prompt expansion with content
pad values (processor) in the HTTP process; the vision encoders (vision) and the encoder-output
cache (encoder_cache) in the engine. The families' encoder + projector modules live in
models/ (llava.py, idefics3.py)."""
