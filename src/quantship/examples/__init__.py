"""Built-in examples: small models and the reference task (scikit-learn digits)."""
