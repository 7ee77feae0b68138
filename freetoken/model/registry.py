"""Architecture name -> model class."""
from .deepseek_v4 import DeepseekV4Model
from .glm_moe_dsa import GlmMoeDsaModel
from .gpt_oss import GptOssModel
from .qwen3_5_moe import Qwen3_5MoeModel
from .qwen3_moe import Qwen3MoeModel

MODELS = {"qwen3_5_moe": Qwen3_5MoeModel, "qwen3_moe": Qwen3MoeModel, "gpt_oss": GptOssModel,
          "glm_moe_dsa": GlmMoeDsaModel, "deepseek_v4": DeepseekV4Model}


def model_class(arch: str):
    return MODELS[arch]
