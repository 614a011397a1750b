"""The configurations: the KVM op's and its budgets, the model's, the mixer kinds' and backbone families'
options, the compile target, the row plan of packed batches, and their JSON form."""
