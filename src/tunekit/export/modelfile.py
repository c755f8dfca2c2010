"""The Ollama Modelfile written beside a GGUF file."""

from __future__ import annotations


def modelfile(gguf_name: str, tokenizer, recipe) -> str:
    """An Ollama Modelfile: the file, its chat template in Ollama's Go syntax (ChatML and Llama 3; other
    templates are left to the one stored in the GGUF), stop tokens and the recipe's greedy generation."""
    template = tokenizer.chat_template or ""
    lines = [f"FROM ./{gguf_name}", ""]
    stops = [tokenizer.eos_token]
    if "<|im_start|>" in template:
        lines.append('TEMPLATE """{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}'
                     '{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}'
                     '<|im_start|>assistant\n"""')
        stops.append("<|im_end|>")
    elif "<|start_header_id|>" in template:
        lines.append('TEMPLATE """<|begin_of_text|>{{- if .System }}<|start_header_id|>system<|end_header_id|>\n\n'
                     '{{ .System }}<|eot_id|>{{ end }}{{- range .Messages }}<|start_header_id|>{{ .Role }}'
                     '<|end_header_id|>\n\n{{ .Content }}<|eot_id|>{{ end }}<|start_header_id|>assistant'
                     '<|end_header_id|>\n\n"""')
        stops.append("<|eot_id|>")
    else:
        lines.append("# chat template: Ollama reads the one stored in the GGUF file (tokenizer.chat_template)")
    if recipe is not None and recipe.data.system_prompt:
        lines.append(f'SYSTEM """{recipe.data.system_prompt}"""')
    lines += [f'PARAMETER stop "{s}"' for s in dict.fromkeys(s for s in stops if s)]
    lines.append("PARAMETER temperature 0")  # greedy, as `tunekit eval` generates
    if recipe is not None and recipe.eval is not None:
        lines.append(f"PARAMETER num_predict {recipe.eval.max_new_tokens}")
    return "\n".join(lines) + "\n"
