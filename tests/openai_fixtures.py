"""Batch files as their users write them, for tests/test_openai_compat.py.

VLLM_*: the inputs of vLLM's own run-batch tests, tests/entrypoints/openai/test_run_batch.py in
vllm-project/vllm (INPUT_BATCH, INVALID_INPUT_BATCH, INPUT_EMBEDDING_BATCH, INPUT_RERANK_BATCH),
their lines as given there.
COOKBOOK_*: the OpenAI cookbook's "Batch processing with the Batch API" (openai/openai-cookbook,
examples/batch_processing.ipynb): its movie-categorizing tasks (JSON mode, gpt-3.5-turbo) and its
image-captioning tasks (a text and an image_url part, max_tokens 300), with a few of its rows.
"""
CHAT_MODEL_NAME = "hmellor/tiny-random-LlamaForCausalLM"
EMBEDDING_MODEL_NAME = "intfloat/multilingual-e5-small"
RERANKER_MODEL_NAME = "BAAI/bge-reranker-v2-m3"


def _chat(cid, system, model=CHAT_MODEL_NAME, url="/v1/chat/completions", **extra):
    return {"custom_id": cid, "method": "POST", "url": url,
            "body": {**extra, "model": model, "messages": [{"role": "system", "content": system},
                                                           {"role": "user", "content": "Hello world!"}],
                     "max_tokens": 1000}}


VLLM_INPUT_BATCH = [
    _chat("request-1", "You are a helpful assistant."),
    _chat("request-2", "You are an unhelpful assistant."),
    _chat("request-3", "You are an unhelpful assistant.", model="NonExistModel"),
    _chat("request-4", "You are an unhelpful assistant.", url="/bad_url"),
    _chat("request-5", "You are an unhelpful assistant.", stream="True"),
]

# its first line has no custom_id (vLLM exits non-zero on it)
VLLM_INVALID_INPUT_BATCH = [
    {"invalid_field": "request-1", **{k: v for k, v in _chat("x", "You are a helpful assistant.").items()
                                      if k != "custom_id"}},
    _chat("request-2", "You are an unhelpful assistant."),
]

VLLM_INPUT_EMBEDDING_BATCH = [
    {"custom_id": f"request-{i}", "method": "POST", "url": "/v1/embeddings", "body": {"model": model, "input": text}}
    for i, (model, text) in enumerate([(EMBEDDING_MODEL_NAME, "You are a helpful assistant."),
                                       (EMBEDDING_MODEL_NAME, "You are an unhelpful assistant."),
                                       (EMBEDDING_MODEL_NAME, "Hello world!"),
                                       ("NonExistModel", "Hello world!")], start=1)
]

_DOCUMENTS = ["The capital of Brazil is Brasilia.", "The capital of France is Paris."]
# custom_id request-2 twice (its second and third lines), as in vLLM's test
VLLM_INPUT_RERANK_BATCH = [
    {"custom_id": cid, "method": "POST", "url": url,
     "body": {"model": RERANKER_MODEL_NAME, "query": "What is the capital of France?", "documents": _DOCUMENTS}}
    for cid, url in [("request-1", "/rerank"), ("request-2", "/v1/rerank"), ("request-2", "/v2/rerank")]
]

_CATEGORIZE_SYSTEM_PROMPT = '''
Your goal is to extract movie categories from movie descriptions, as well as a 1-sentence summary for these movies.
You will be provided with a movie description, and you will output a json object containing the following information:

{
    categories: string[] // Array of categories based on the movie description,
    summary: string // 1-sentence summary of the movie based on the movie description
}

Categories refer to the genre or type of the movie, like "action", "romance", "comedy", etc. Keep category names simple and use only lower case letters.
Movies can have several categories, but try to keep it under 3-4. Only mention the categories that are the most obvious based on the description.
'''
_OVERVIEWS = [
    "Two imprisoned men bond over a number of years, finding solace and eventual redemption through acts of "
    "common decency.",
    "An organized crime dynasty's aging patriarch transfers control of his clandestine empire to his reluctant son.",
    "A jury holdout attempts to prevent a miscarriage of justice by forcing his colleagues to reconsider the evidence.",
]
COOKBOOK_MOVIES = [
    {"custom_id": f"task-{index}", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "gpt-3.5-turbo", "temperature": 0.1, "response_format": {"type": "json_object"},
              "messages": [{"role": "system", "content": _CATEGORIZE_SYSTEM_PROMPT},
                           {"role": "user", "content": description}]}}
    for index, description in enumerate(_OVERVIEWS)
]

_CAPTION_SYSTEM_PROMPT = '''
Your goal is to generate short, descriptive captions for images of items.
You will be provided with an image and the name of the item that is depicted in the image.
Only use the information you can determine from the image.
'''
_FURNITURE = [
    ("GOYMFK 1pc Free Standing Shoe Rack, Multi-layer Metal Shoe Cap Rack With 8 Double Hooks",
     "https://m.media-amazon.com/images/I/416WaLx10jL._SS522_.jpg"),
    ("subrtex Leather ding Room, Dining Chairs Set of 2, Black",
     "https://m.media-amazon.com/images/I/31SejUEWY7L._SS522_.jpg"),
]
COOKBOOK_CAPTIONS = [
    {"custom_id": f"task-{index}", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "gpt-4o-mini", "temperature": 0.2, "max_tokens": 300,
              "messages": [{"role": "system", "content": _CAPTION_SYSTEM_PROMPT},
                           {"role": "user", "content": [{"type": "text", "text": title},
                                                        {"type": "image_url", "image_url": {"url": url}}]}]}}
    for index, (title, url) in enumerate(_FURNITURE)
]

# vLLM's INPUT_SCORE_BATCH (queries and documents, at /score and /v1/score), and its INPUT_RERANK_BATCH's
# three urls with a custom_id each (its file repeats request-2, which jobrunner refuses: see VLLM_INPUT_RERANK_BATCH)
VLLM_INPUT_SCORE_BATCH = [
    {"custom_id": cid, "method": "POST", "url": url,
     "body": {"model": RERANKER_MODEL_NAME, "queries": "What is the capital of France?", "documents": _DOCUMENTS}}
    for cid, url in [("request-1", "/score"), ("request-2", "/v1/score")]
]
VLLM_RERANK_LINES = [{**x, "custom_id": f"rerank-{i}"} for i, x in enumerate(VLLM_INPUT_RERANK_BATCH, start=1)]

REASONING_MODEL_NAME = "Qwen/Qwen3-0.6B"
# vLLM's INPUT_REASONING_BATCH (no max_tokens: the job's)
VLLM_INPUT_REASONING_BATCH = [
    {"custom_id": f"request-{i}", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": REASONING_MODEL_NAME, "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                                          {"role": "user", "content": question}]}}
    for i, question in enumerate(["Solve this math problem: 2+2=?", "What is the capital of France?"], start=1)
]
