"""radixlm.runtime.engine"""
