"""The coefficients of `tunekit plan`'s GPU step time (plan.steptime), fitted by bench/plan_time_fit.py to the GPU
check's recorded runs, and where they come from. Written by that script: run it again rather than edit them."""

FIT = {'basis': 'estimated from runs measured on an H100 and an H200 (bench/plan_time_fit.py)',
       'gpus': ['H100', 'H200'],
       'script': 'bench/plan_time_fit.py',
       'runs': {'H100': {'file': 'bench/gpu_check_h100.json', 'commit': 'e22c0af', 'device': 'NVIDIA H100 80GB HBM3'},
                'H200': {'file': 'bench/gpu_check.json', 'commit': 'd9ba231', 'device': 'NVIDIA H200'}},
       'operators': {'adapter_forward': 14.0,
                     'adapter_backward': 24.0,
                     'layer_forward': 81.0,
                     'layer_backward': 103.0,
                     'adapter_forward_dropout': 18.0,
                     'adapter_backward_dropout': 25.0,
                     'layer_backward_full': 164},
       'coefficients': {'seconds_per_operator': 1.979175122934496e-05,
                        'seconds_per_four_bit_use': 0.0003157284896785587,
                        'seconds_per_zero3_gather': 0.0007370099089118912,
                        'seconds_per_fsdp_gather': 0.0018197970571084698,
                        'varying_rows_seconds': 0.26696732161127557},
       'worst': [1.4448297751971149, 'H200 vlm-qlora'],
       'rows': 21}
