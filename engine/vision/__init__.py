"""Images for vision-language models, torch-free: what the engine's families need of a checkpoint's vision side.

    config.py      VisionConfig: the vision tower's and projector's hyperparameters (config.json's vision_config
                   and the multimodal keys beside it), a field of ModelConfig
    processor.py   ImageProcessor: PIL image -> PreparedImage (pixels, patch grid, placeholder count), exact
                   against transformers' *Pil image processors; image_key; expand (a prompt's image tokens
                   repeated); load_image_processor (preprocessor_config.json)
    positions.py   mrope_positions: Qwen2-VL's multimodal rotary positions of a prompt (numpy)

The towers themselves (torch) live with their families: engine/models/qwen2_vl.py, engine/models/llava.py,
over engine/models/vision_language.py.
"""
