//! The model as the engine sees it, read from a burn module with its [`ModuleVisitor`]: every
//! module by its path (`blocks.3.linear`), every trainable float parameter by its path and
//! [`ParamId`], in the order the visitor walks them.

use std::collections::HashMap;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;
use neuraldbg_core::ModelSpec;

/// What the adapter keeps between steps: the engine's model description and where each burn
/// parameter (by id) sits in its parameter list.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    pub spec: ModelSpec,
    pub position: HashMap<ParamId, usize>,
}

impl Layout {
    /// Walks `module` once. Modules are listed as their walk completes (children before their
    /// parent, the root last), which is forward order for a model whose fields are declared in
    /// the order its `forward` uses them.
    pub fn of<M: Module>(module: &M) -> Self {
        let mut walk = Walk {
            frames: vec![Frame {
                name: String::new(),
                kind: None,
                param: false,
            }],
            modules: Vec::new(),
            params: Vec::new(),
            skip: 0,
        };
        module.visit(&mut walk);
        let root = walk.frames.pop().expect("the root frame is never popped");
        let root_kind = root
            .kind
            .unwrap_or_else(|| short_type_name::<M>().to_string());
        walk.modules.push((String::new(), root_kind));

        let mut spec = ModelSpec {
            framework: Some("burn".into()),
            ..ModelSpec::default()
        };
        let index: HashMap<String, usize> = walk
            .modules
            .iter()
            .map(|(path, kind)| (path.clone(), spec.module(path.clone(), kind.clone())))
            .collect();
        let mut position = HashMap::with_capacity(walk.params.len());
        // Parameters grouped by module (the engine sums a layer's norms in one pass when each
        // layer's parameters are contiguous), modules in forward order.
        let mut params = walk.params;
        params.sort_by_key(|p| index[&p.owner]);
        for p in params {
            let module = index[&p.owner];
            let i = spec.param(module, p.path, &p.shape);
            match spec.modules[module].kind.as_str() {
                // burn stores a Linear weight as [d_input, d_output] (PyTorch: [out, in]).
                "Linear" if p.shape.len() == 2 && spec.params[i].fan_in.is_some() => {
                    spec.params[i].fan_in = Some(p.shape[0]);
                }
                // A lookup table: its scale says nothing about signal propagation.
                "Embedding" => spec.params[i].fan_in = None,
                _ => {}
            }
            position.insert(p.id, i);
        }
        Self { spec, position }
    }
}

/// `my_crate::model::Net<B>` -> `Net`.
fn short_type_name<T>() -> &'static str {
    let full = std::any::type_name::<T>();
    let base = full.split('<').next().unwrap_or(full);
    base.rsplit("::").next().unwrap_or(base)
}

struct Frame {
    name: String,
    /// The module's type, learned from its first child (burn names the parent's type when it
    /// enters a field); None for a field without fields of its own.
    kind: Option<String>,
    /// The frame is a parameter's field, not a module.
    param: bool,
}

struct PendingParam {
    path: String,
    owner: String,
    shape: Vec<u64>,
    id: ParamId,
}

struct Walk {
    frames: Vec<Frame>,
    modules: Vec<(String, String)>,
    params: Vec<PendingParam>,
    /// Depth inside a parameter's reparameterization (`LoRA`): its internals are not the model's.
    skip: usize,
}

impl Walk {
    /// Path of the frames `1..end` (the root frame has no name).
    fn path(&self, end: usize) -> String {
        let names: Vec<&str> = self.frames[1..end]
            .iter()
            .map(|f| f.name.as_str())
            .collect();
        names.join(".")
    }
}

/// burn's container names: `Struct:Linear`, `Enum:Activation`, `Vec`, `Tuple`, `Array`.
fn kind_of(container_type: &str) -> String {
    container_type
        .split_once(':')
        .map_or(container_type, |(_, name)| name)
        .to_string()
}

impl ModuleVisitor for Walk {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        if self.skip > 0 || container_type == "Reparameterization" {
            self.skip += 1;
            return;
        }
        if let Some(parent) = self.frames.last_mut() {
            parent.kind.get_or_insert_with(|| kind_of(container_type));
        }
        self.frames.push(Frame {
            name: name.to_string(),
            kind: None,
            param: false,
        });
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        if self.skip > 0 {
            self.skip -= 1;
            return;
        }
        let path = self.path(self.frames.len());
        let frame = self.frames.pop().expect("exit matches an enter");
        // A field without fields of its own is a parameter, an absent `Option`, or a module
        // without parameters or type name to show (burn's `Relu`): nothing the engine uses.
        if let (false, Some(kind)) = (frame.param, frame.kind) {
            self.modules.push((path, kind));
        }
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.skip > 0 {
            return;
        }
        let n = self.frames.len();
        // A parameter is entered as a field of its module: the top frame is the parameter, the
        // one below it its owner. A model that is a bare parameter is its own owner.
        if n > 1 {
            self.frames[n - 1].param = true;
        }
        // A shared (tied) parameter is listed once, where the walk first meets it.
        if !param.is_require_grad() || self.params.iter().any(|p| p.id == param.id) {
            return;
        }
        let (path, owner) = if n > 1 {
            (self.path(n), self.path(n - 1))
        } else {
            ("value".to_string(), String::new())
        };
        self.params.push(PendingParam {
            path,
            owner,
            shape: param.dims().iter().map(|&d| d as u64).collect(),
            id: param.id,
        });
    }
}

#[cfg(test)]
mod tests {
    use burn::module::{Module, Param};
    use burn::nn::{Linear, LinearConfig, Relu};
    use burn::tensor::{Device, Tensor};
    use neuraldbg_core::ParamRole;

    use super::Layout;

    #[derive(Module, Debug)]
    struct Block {
        fc: Linear,
        act: Relu,
        scale: Param<Tensor<1>>,
    }

    #[derive(Module, Debug)]
    struct Net {
        stem: Linear,
        blocks: Vec<Block>,
        frozen: Linear,
    }

    fn net(device: &Device) -> Net {
        let block = || Block {
            fc: LinearConfig::new(4, 4).init(device),
            act: Relu::new(),
            scale: Param::from_tensor(Tensor::ones([4], device)),
        };
        Net {
            stem: LinearConfig::new(3, 4).with_bias(false).init(device),
            blocks: vec![block(), block()],
            frozen: LinearConfig::new(4, 2).init(device).no_grad(),
        }
    }

    #[test]
    fn modules_by_path_children_first_and_parameters_grouped_by_module() {
        let device = Device::default().autodiff();
        let layout = Layout::of(&net(&device));
        let modules: Vec<(&str, &str)> = layout
            .spec
            .modules
            .iter()
            .map(|m| (m.name.as_str(), m.kind.as_str()))
            .collect();
        assert_eq!(
            modules,
            [
                ("stem", "Linear"),
                ("blocks.0.fc", "Linear"),
                ("blocks.0", "Block"),
                ("blocks.1.fc", "Linear"),
                ("blocks.1", "Block"),
                ("blocks", "Vec"),
                ("frozen", "Linear"),
                ("", "Net"),
            ]
        );
        let params: Vec<(&str, usize, u64, Option<u64>, ParamRole)> = layout
            .spec
            .params
            .iter()
            .map(|p| (p.name.as_str(), p.module, p.numel, p.fan_in, p.role))
            .collect();
        // The frozen layer's parameters are not trainable: not listed. burn's Linear weight is
        // [d_input, d_output], so its fan-in is the first dimension.
        assert_eq!(
            params,
            [
                ("stem.weight", 0, 12, Some(3), ParamRole::Weight),
                ("blocks.0.fc.weight", 1, 16, Some(4), ParamRole::Weight),
                ("blocks.0.fc.bias", 1, 4, None, ParamRole::Bias),
                ("blocks.0.scale", 2, 4, None, ParamRole::Other),
                ("blocks.1.fc.weight", 3, 16, Some(4), ParamRole::Weight),
                ("blocks.1.fc.bias", 3, 4, None, ParamRole::Bias),
                ("blocks.1.scale", 4, 4, None, ParamRole::Other),
            ]
        );
        assert_eq!(layout.position.len(), 7);
        let model = net(&device);
        let stem = Layout::of(&model).position[&model.stem.weight.id];
        assert_eq!(stem, 0);
    }

    #[test]
    fn a_shared_parameter_is_listed_once() {
        let device = Device::default().autodiff();
        let fc = LinearConfig::new(2, 2).init(&device);
        let tied = vec![fc.clone(), fc];
        let layout = Layout::of(&tied);
        let names: Vec<&str> = layout.spec.params.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["0.weight", "0.bias"]);
        assert_eq!(
            layout.spec.modules.last().map(|m| m.kind.as_str()),
            Some("Vec")
        );
    }
}
