"""Client APIs beside OpenAI's chat completions, translated in the proxy."""
