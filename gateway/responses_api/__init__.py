"""OpenAI's Responses API, ``POST /v1/responses``, stateless: a request becomes the very ``Job``
a chat completion would (chat template, tools, output constraints as the chat path does them)
and its output becomes ``response`` objects and the Responses stream's events::

    ResponsesRequest (models)  --translate-->  ChatCompletionRequest --jobs.prepare_chat--> Job
    JobRun updates --tools.ToolOutput--> OutputItems (output) --> body or SSE (serve)

Nothing is stored: ``store: true`` and ``previous_response_id`` are refused (``translate``).
"""
