"""A chat with memory (``POST /v1/chat/completions``): ``routes.py`` answers it (retrieve, compose,
send to the engine as completions, answer again as text if the engine could not load the memory),
``request.py`` reads what the client asked (whose memory, k, mode) and builds what goes to vLLM,
``answers.py`` reshapes vLLM's completions (whole or streamed) as chat completions."""
