"""Images and audio for the built-in instance (a model with a multimodal
projector, llama.cpp's ``mmproj``).

* :mod:`.sources`: a client's media reference (``data:`` URL, bare base64,
  an ``http(s)`` URL when ``--media-fetch`` allows it) to bytes, bounded;
* :mod:`.probe`: what the bytes are (image or audio, its size or length)
  read from their header, before anything is decoded;
* :mod:`.parts`: OpenAI chat content parts (which every client API's
  adapter produces) to prompt text with media markers and the media in
  order, as llama-server's ``oaicompat_content_load_media``;
* :mod:`.projector`: libmtmd (llama-cpp-python's ``mtmd_cpp``) loaded
  beside the model: a prompt with markers to tokens and media spans, a
  span's embeddings;
* :mod:`.spans`: a prompt's media span (where it sits among the tokens,
  its content hash and the placeholder ids that stand for it, so every
  prefix cache compares media by content).

No HTTP here; :mod:`ggmux.instance.llama` maps requests to these calls.
"""
