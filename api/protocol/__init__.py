"""Request schemas (pydantic) of the OpenAI-shaped endpoints, with xpu-jobs' documented extension fields."""
