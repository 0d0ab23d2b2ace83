"""Extensions outside the core API. Empty for now: new contributions land here
before they graduate into ``bagua.torch_api``."""
