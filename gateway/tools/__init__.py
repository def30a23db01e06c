"""Tool calling: request fields (``models``, ``request``), the constraint of a required or named
``tool_choice`` (``constraint``), and the parsing of a choice's output into tool calls
(``stages``, hooked into the response by ``output``)."""
