"""Sentence embeddings (``/v1/embeddings``): a BERT encoder or the repository's decoder, pooled
and normalised as the model's sentence-transformers files say.

    sentence_config.py  modules.json, 1_Pooling/, sentence_bert_config.json (torch-free)
    tokenize.py         text → ids, truncating or refusing over-long inputs (torch-free)
    bert.py             BertEncoder: transformers' BertModel over a packed batch
    decoder.py          DecoderEncoder: engine/model.py's CausalLM, final states, no KV kept
    pooling.py          mean / cls / lasttoken / max / ... and L2 normalisation
    model.py            EmbeddingModel: the API a worker calls

This package file imports nothing, so the torch-free modules stay torch-free.
"""
