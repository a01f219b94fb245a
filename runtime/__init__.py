"""radixlm.runtime"""
