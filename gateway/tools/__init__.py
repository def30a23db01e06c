"""Tool calling: request fields (``models``, ``request``), the calls as the response carries them
(``calls``), and the parsing of a choice's output into tool calls (``stages``, hooked into the
response by ``gateway.responses.ToolOutput``). The constraint of a required or named
``tool_choice`` is an output constraint like the others: ``gateway.structured``."""
