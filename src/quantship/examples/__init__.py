"""Built-in examples: small models, the reference task (scikit-learn digits), and tasks that stress quantization."""
